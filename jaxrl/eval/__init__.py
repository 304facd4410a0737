"""`jaxrl eval`: accuracy and process metrics of completions. run.py generates (or reads) them,
metrics.py scores a set (accuracy with a Wilson interval, Spring's table from spring_metrics.py,
CEDAR's process metrics from cedar_metrics.py), table.py prints the results."""
