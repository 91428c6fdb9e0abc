"""What a `package.module:attr` model name names, imported (a user's factory, or a kind of
the user's own): one line when it does not import, never a traceback on every rank."""
from __future__ import annotations

import importlib
from typing import Callable

from enn_cluster.errors import UserError


def import_factory(path: str) -> Callable:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"model.name: cannot import {module_name!r} ({exc}); make it importable "
                        "on every node (PYTHONPATH or pip install)")
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise UserError(f"model.name: {module_name} has no attribute {attr!r}")
    return obj


def check_factory(name: str) -> object:
    """A `module:attr` must import in the workers: import it now (the workers would run the
    same import), so that a typo is one line here rather than a traceback on every rank.
    Returns what it names."""

    import importlib.util

    module, attr = name.split(":", 1)
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UserError(f"model.name: module {module!r} is not importable; put it on "
                        "PYTHONPATH (every node must see it) or pip install it")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise UserError(f"model.name: module {module!r} has no {attr!r}; name a class or "
                        "function that returns an nn.Module") from None
    except Exception as exc:  # the user's module failed to import: say so in one line
        raise UserError(f"model.name: importing {module!r} failed ({type(exc).__name__}: "
                        f"{str(exc)[:200]}); fix the module") from None
    import inspect

    if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismethod(obj)
            or callable(getattr(obj, "build", None))):  # a model kind's instance
        raise UserError(f"model.name: {name} is a {type(obj).__name__}, not a model factory "
                        "(a class or Python function returning an nn.Module)")
    return obj


def check_call(name: str, kwargs: dict) -> None:
    """The factory takes `n_features`, `n_outputs` and model.kwargs, by its signature (no
    call): a keyword it lacks is one line here rather than a TypeError on every rank."""
    import inspect

    obj = import_factory(name)
    if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismethod(obj)):
        return
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin or C extension: nothing to read
        return
    try:
        signature.bind(n_features=1, n_outputs=1, **kwargs)
    except TypeError as exc:
        raise UserError(f"model.kwargs: {name}{str(signature)[:160]} cannot be called with "
                        f"n_features, n_outputs and {sorted(kwargs)} ({exc}); give model.kwargs "
                        "the keywords it takes") from None
