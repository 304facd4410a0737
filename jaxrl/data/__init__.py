"""Task data: records (records.py), procedural generators (generators/), dataset loaders
(loaders.py over the formats in sources.py), prompts (prompts.py) and the grain pipeline
(pipeline.py). Submodules are imported where used, so `import jaxrl.data.records` stays light.

Typical use in a training loop:

    from jaxrl.data.pipeline import build_pool, train_iterator
    from jaxrl.data.prompts import prompt_fits
    pool = build_pool(cfg.data, keep=prompt_fits(tokenizer, cfg.data.max_prompt_tokens))
    batches = train_iterator(pool, cfg.data)      # next(batches) -> list of records
    state = batches.get_state()                   # JSON; batches.set_state(state) resumes
"""
