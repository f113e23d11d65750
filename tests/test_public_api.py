"""The public API's surface (CPU only): `__all__` lists it exactly, every public symbol is documented
and fully annotated with hints that resolve under the installed jax, the PEP 561 marker ships, and
the optional flax integration stays out of `import fa4_jax`."""

from __future__ import annotations

import importlib
import inspect
import pathlib
import subprocess
import sys
import types
import typing

import pytest

import fa4_jax
import fa4_jax.export
import fa4_jax.core.partitioning

def _public_callables(module) -> list[tuple[str, object]]:
    return [(name, getattr(module, name)) for name in module.__all__ if callable(getattr(module, name))]


def _missing_annotations(func, *, needs_return: bool = True) -> list[str]:
    """The parameters (and "return") of `func` without a type hint; raises if a hint does not resolve."""
    hints = typing.get_type_hints(func)  # evaluates every string annotation: a bad one raises here
    missing = [name for name, p in inspect.signature(func).parameters.items()
               if name not in ("self", "cls") and name not in hints]
    if needs_return and "return" not in hints:
        missing.append("return")
    return missing


def _check_class(cls) -> list[str]:
    """The constructor's parameters (its return may stay implicit, PEP 484) and every public method
    or property the class defines itself must be annotated."""
    problems = [f"{cls.__name__}.__init__({name})" for name in _missing_annotations(cls.__init__, needs_return=False)]
    for name, member in vars(cls).items():
        if name.startswith("_") and name != "__call__":
            continue
        func = member.fget if isinstance(member, property) else member
        if isinstance(func, (staticmethod, classmethod)):
            func = func.__func__
        if isinstance(func, types.FunctionType):
            problems += [f"{cls.__name__}.{name}({p})" for p in _missing_annotations(func)]
    return problems


def _check_api(module) -> None:
    names = module.__all__
    assert len(names) == len(set(names)), f"duplicates in {module.__name__}.__all__: {names}"
    missing = [name for name in names if not hasattr(module, name)]
    assert not missing, f"{module.__name__}.__all__ names what the module does not define: {missing}"
    undocumented = [name for name, obj in _public_callables(module) if not (obj.__doc__ or "").strip()]
    assert not undocumented, f"undocumented public symbols in {module.__name__}: {undocumented}"
    problems = []
    for name, obj in _public_callables(module):
        if inspect.isclass(obj):
            problems += _check_class(obj)
        else:
            problems += [f"{name}({p})" for p in _missing_annotations(obj)]
    assert not problems, f"missing type hints in {module.__name__}: {problems}"


def test_all_is_the_public_api():
    _check_api(fa4_jax)
    assert fa4_jax.__doc__ and fa4_jax.__doc__.strip()
    assert isinstance(fa4_jax.__version__, str) and "__version__" in fa4_jax.__all__
    # Every public name __init__.py binds is listed: everything but underscored names and submodules
    # (bound as a side effect of importing from them; fa4_jax.export is public, but as a submodule
    # the package docstring names, not through __all__).
    public = {name for name, obj in vars(fa4_jax).items()
              if not name.startswith("_") and not isinstance(obj, types.ModuleType)}
    assert public == set(fa4_jax.__all__) - {"__version__"}, (
        f"not in __all__: {sorted(public - set(fa4_jax.__all__))}; "
        f"in __all__ but not bound: {sorted(set(fa4_jax.__all__) - {'__version__'} - public)}")
    # The package docstring points at the public submodules.
    for submodule in ("fa4_jax.export", "fa4_jax.flax"):
        assert submodule in fa4_jax.__doc__, submodule


def test_entry_points_are_the_functions_not_submodules():
    # `from fa4_jax import attention` rebinds the name the submodule import set.
    for name in ("attention", "attention_with_kvcache", "update_kvcache", "attention_varlen"):
        assert inspect.isfunction(getattr(fa4_jax, name)), name


def test_return_hints_say_what_return_lse_switches():
    import jax

    switched = typing.Union[jax.Array, tuple[jax.Array, jax.Array]]
    for func in (fa4_jax.attention, fa4_jax.attention_with_kvcache, fa4_jax.attention_varlen):
        hints = typing.get_type_hints(func)
        assert hints["return"] == switched, (func.__name__, hints["return"])
        assert hints["window_size"] == tuple[int, int]
        assert set(typing.get_args(hints["implementation"])) == {typing.Literal["fa4", "cudnn", "xla"], type(None)}
    pair = tuple[jax.Array, jax.Array]
    for func in (fa4_jax.attention_reference, fa4_jax.attention_with_kvcache_reference,
                 fa4_jax.attention_varlen_reference, fa4_jax.update_kvcache, fa4_jax.ops.kvcache.sharding.merge_partials):
        assert typing.get_type_hints(func)["return"] == pair, func.__name__


def test_export_module_api():
    _check_api(fa4_jax.export)
    assert fa4_jax.export.__doc__.strip()
    assert fa4_jax.export_safety_checks is fa4_jax.export.export_safety_checks


def test_merge_partials_is_documented_and_annotated():
    func = fa4_jax.ops.kvcache.sharding.merge_partials
    assert (func.__doc__ or "").strip()
    assert _missing_annotations(func) == []


def test_py_typed_marker_in_package():
    marker = pathlib.Path(fa4_jax.__file__).parent / "py.typed"
    assert marker.is_file(), f"{marker} missing (PEP 561)"


def test_flax_api():
    pytest.importorskip("flax")
    module = importlib.import_module("fa4_jax.flax")
    assert {"FA4Attention", "dot_product_attention"} <= set(module.__all__)
    assert module.__doc__ and module.__doc__.strip()
    _check_api(module)


def test_import_does_not_import_flax():
    # A fresh interpreter: this test process may already hold flax from other tests.
    code = "import sys, fa4_jax; assert 'flax' not in sys.modules, sorted(m for m in sys.modules if 'flax' in m)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
