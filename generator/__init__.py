"""epgen generator: specs/ (TOML) -> variants -> rendered GPU sources -> compiled, ISA-verified code objects."""

__version__ = "0.1.0"
__epgen__ = "generator"  # epgen's top-level packages carry their own name here (foreign() checks it)

TOP_LEVEL = ("generator", "runtime", "bench")  # epgen's generic top-level names (README "Package names")


def foreign(name: str) -> str | None:
    """Why the top-level package `name` that Python finds is not epgen's (another distribution or a folder of
    that name earlier on sys.path), as one line; None when it is epgen's."""
    import importlib
    import importlib.metadata

    try:
        mod = importlib.import_module(name)
    except ImportError as e:
        extra = (" (the runtime and bench need it: pip install 'epgen[runtime]')"
                 if e.name in ("torch", "numpy") and "epgen[runtime]" not in str(e) else "")
        return f"'{name}' cannot be imported: {e}{extra}"
    if getattr(mod, "__epgen__", None) == name:
        return None
    where = getattr(mod, "__file__", None) or ", ".join(getattr(mod, "__path__", [])) or "a namespace package"
    others = [d for d in importlib.metadata.packages_distributions().get(name, []) if d != "epgen"]
    by = f" (installed by {', '.join(sorted(set(others)))})" if others else ""
    return (f"the '{name}' package Python imports, {where}{by}, is not epgen's: a package or folder named '{name}' "
            f"comes first on sys.path; run from another folder, or install epgen in a venv of its own")
