"""Session setup for the whole test tree (pytest reads this before collecting).

With the `interpret` marker selected (`pytest -m interpret`), Triton's interpreter has to
be on before the first test module is imported: with fla installed, Hugging Face's model
modules (imported by many test modules) import fla, and fla decorates its kernels when it
is imported, compiled or interpreted for good. `tests/ops/interpret.py` sets it. Any other
selection leaves the environment alone (a GPU run keeps its compiled kernels).
"""


def pytest_configure(config):
    expr = config.getoption("markexpr", "") or ""
    if "interpret" in expr and "not interpret" not in expr:
        import tests.ops.interpret  # noqa: F401  sets TRITON_INTERPRET=1
