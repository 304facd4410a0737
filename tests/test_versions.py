"""The JAX release setup.py pins is the one these tests run on, and its libtpu pin the one
that release pairs with."""
import ast
from importlib.metadata import requires
from pathlib import Path

import jax
import jaxlib
from packaging.requirements import Requirement

SETUP = Path(__file__).resolve().parents[1] / "setup.py"


def _pins() -> dict[str, str]:
    tree = ast.parse(SETUP.read_text())
    return {node.targets[0].id: node.value.value for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            and isinstance(node.targets[0], ast.Name)}


def test_setup_pins_the_jax_the_tests_run_on():
    pins = _pins()
    assert jax.__version__ == pins["JAX"] and jaxlib.__version__ == pins["JAX"], (
        f"tests run on jax {jax.__version__} / jaxlib {jaxlib.__version__}; setup.py pins "
        f"{pins['JAX']}: run the tests on the new release, then move the pin")
    tpu = [Requirement(r) for r in requires("jax") if r.startswith("libtpu")]
    assert tpu and all(r.specifier.contains(pins["LIBTPU"]) for r in tpu), (
        f"libtpu {pins['LIBTPU']} is not what jax[tpu] {jax.__version__} asks for: {tpu}")
