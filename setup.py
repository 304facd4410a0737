"""jaxrl: GRPO post-training in JAX with LoRA adapters over NF4 base weights."""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
# The JAX release the tests pass with (CPU; TPU compiles through libtpu for `jaxrl plan`), and
# the libtpu that release pairs with. launch/tpu_pod.sh installs exactly these on every worker.
JAX = "0.10.2"
LIBTPU = "0.0.42.1"

setup(
    name="jaxrl",
    version="0.1.0",
    description="GRPO post-training in JAX: NF4 base weights, LoRA adapters, sharded sampling "
    "and updates, async Z3 and LLM-judge rewards, PEFT export.",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["jaxrl", "jaxrl.*"]),
    package_data={"jaxrl": ["py.typed", "agents/roles/*.yaml", "envs/*.yaml",
                            "model/presets/*.json"]},
    include_package_data=True,
    install_requires=[
        f"jax=={JAX}",
        f"jaxlib=={JAX}",
        "flax>=0.10",
        "optax>=0.2.4",
        "orbax-checkpoint>=0.10",
        "transformers>=4.56",
        "filelock>=3.12",  # one process at a time prepares the default model
        "safetensors>=0.4",
        "tokenizers>=0.21",
        "jinja2>=3.1",  # chat templates (transformers imports it only when rendering one)
        "huggingface-hub>=0.26",
        "ml_dtypes>=0.4",
        "pyarrow>=15",
        "z3-solver>=4.13",
        "datasets>=3.0",
        "tensorstore>=0.1.70",
        "openai>=1.50",
        "uvicorn>=0.30",  # jaxrl serve: the HTTP server
        "starlette>=0.40",  # jaxrl serve: the ASGI application
        "prometheus_client>=0.20",  # jaxrl serve: /metrics
        "grain>=0.2.10",
        "numpy>=1.26",
        "pyyaml>=6.0",
        "rich>=13.0",
        "gguf>=0.19",
        "llguidance>=1.9,<2",  # jaxrl serve: structured output (response_format, guided_*)
        "matplotlib>=3.7",
    ],
    extras_require={
        "test": [
            "pytest>=8.0",
            "pytest-xdist>=3.5",
            "torch==2.13.0",
            "peft>=0.14",
            "hypothesis>=6.100",
            "bitsandbytes>=0.45",
            "tensorboard>=2.15",
            "wandb>=0.19.10,<1",  # tests/run/test_trackers.py: logging.wandb, offline
            # tests/serve/test_lm_eval.py: lm-evaluation-harness against `jaxrl serve`
            "lm_eval[api]>=0.4.13,<0.5",
        ],
        "wandb": ["wandb>=0.19.10,<1"],  # logging.wandb (reinit="create_new": 0.19.10)
        "tpu": [f"jax[tpu]=={JAX}", f"libtpu=={LIBTPU}"],
        "gpu": [f"jax[cuda12]=={JAX}"],
    },
    entry_points={"console_scripts": ["jaxrl=jaxrl.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
