"""README promises: CI runs exactly the README's test command."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fenced_commands(text: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line.strip() for b in blocks for line in b.splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Tests", 1)[1].split("\n## ", 1)[0]
    (command,) = _fenced_commands(section)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in [line.strip() for line in ci]


def test_ci_runs_the_quickstart_from_a_bare_install():
    """CI runs `jaxrl train` in a venv holding `pip install -e .` alone (no test extra, whose
    torch brings packages the CLI needs) before the tests: the venv's `jaxrl` command starts and
    the accelerator check's tiny form, whose last step is the quickstart, runs with that venv
    first on PATH; CI then checks the quickstart's run directory."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    (command,) = _fenced_commands(section)
    assert command == "pip install -e . && jaxrl train"
    ci = (ROOT / ".ci" / "run").read_text()
    bare, tests = ci.index('"$venv/bin/pip" install -q -e . '), ci.index("pip install -e '.[test]'")
    assert bare < ci.index('"$venv/bin/jaxrl" --help') < tests
    assert bare < ci.index('PATH="$venv/bin:$PATH" tools/accelerator_check.sh --tiny') < tests
    check = (ROOT / "tools" / "accelerator_check.sh").read_text()
    assert "run_step quickstart jaxrl train run.steps=1" in check
    for path in ("metrics.jsonl", "report.png", "adapter/adapter_config.json"):
        assert path in ci
