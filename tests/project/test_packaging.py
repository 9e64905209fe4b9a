"""The installable distribution: where specs, templates and generated sources are found (checkout,
override, installed package), and the dependencies the runtime declares. scripts/wheel_check.sh
(CI) builds and installs the real wheel in a fresh venv."""

from __future__ import annotations

import tomllib
from pathlib import Path

from generator import build as gbuild
from generator import specs as gspecs

ROOT = Path(__file__).resolve().parents[2]


def test_checkout_specs_are_the_default(monkeypatch):
    monkeypatch.delenv(gspecs.SPECS_ENV, raising=False)
    assert gspecs.checkout_root() == ROOT
    assert gspecs.default_root() == ROOT / "specs"
    assert gbuild.generated_root(gspecs.load()) == ROOT / "generated"


def test_env_overrides_the_specs_folder(monkeypatch, spec_copy):
    monkeypatch.setenv(gspecs.SPECS_ENV, str(spec_copy))
    assert gspecs.default_root() == spec_copy
    assert gbuild.generated_root(gspecs.load()) == spec_copy.parent / "generated"
    assert gspecs.templates_root(spec_copy).resolve() == (ROOT / "templates").resolve()


def test_installed_layout_finds_packaged_data_and_writes_to_the_cache(monkeypatch, tmp_path):
    """Without a checkout beside the package, specs and templates come from generator/data/ and rendered
    sources go under the cache dir (never into site-packages)."""
    data = tmp_path / "site" / "generator" / "data"
    data.mkdir(parents=True)
    (data / "specs").symlink_to(ROOT / "specs")
    (data / "templates").symlink_to(ROOT / "templates")
    monkeypatch.delenv(gspecs.SPECS_ENV, raising=False)
    monkeypatch.delenv(gbuild.GENERATED_ENV, raising=False)
    monkeypatch.setenv("EPGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gspecs, "checkout_root", lambda: None)
    monkeypatch.setattr(gspecs, "packaged_root", lambda: data)
    assert gspecs.default_root() == data / "specs"
    specs = gspecs.load()
    assert gspecs.is_packaged(specs.root)
    out = gbuild.generated_root(specs)
    assert out.parent == tmp_path / "cache" / "generated" and out.name.endswith(specs.digest[:12])
    written, _ = gbuild.write_target(specs, "gfx950")
    assert written and (out / "gfx950" / "manifest.json").is_file()
    monkeypatch.setenv(gbuild.GENERATED_ENV, str(tmp_path / "mine"))
    assert gbuild.generated_root(specs) == tmp_path / "mine"


def test_runtime_extras_declare_every_import():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    names = {extra: {req.split(">")[0].split("=")[0].split("[")[0] for req in reqs} for extra, reqs in extras.items()}
    for extra in ("runtime", "nvidia", "amd"):
        assert {"torch", "numpy"} <= names[extra], extra  # numpy: torch's object collectives (config agreement)
    assert "cuda-bindings" in names["nvidia"] and "hip-python" in names["amd"]
    assert {"jinja2", "attrs"} <= {req.split(">")[0] for req in project["dependencies"]}


def test_wheel_ships_specs_and_templates():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["package-dir"] == {"generator.data.specs": "specs", "generator.data.templates": "templates"}
    subdirs = {p.name for p in (ROOT / "templates").iterdir() if p.is_dir()}
    assert {f"generator.data.templates.{d}" for d in subdirs} <= set(tool["packages"])  # every template folder
    assert all(p.suffix == ".j2" for p in (ROOT / "templates").rglob("*") if p.is_file())
    assert all(p.suffix == ".toml" for p in (ROOT / "specs").iterdir())


def test_wheel_ships_every_python_package():
    """Every folder of the project's packages that holds an __init__.py is declared, so a new subpackage
    cannot be left out of the wheel (it imports in a checkout and fails installed)."""
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for top in ("epgen", "generator", "runtime", "bench")
             for p in (ROOT / top).rglob("__init__.py")}
    assert found and "runtime.backends" in found
    assert found - declared == set(), f"packages missing from pyproject.toml: {sorted(found - declared)}"


def _third_party_imports(paths) -> set[str]:
    import ast
    import sys

    ours = {"generator", "runtime", "bench", "epgen", "tests"} | {p.stem for p in (ROOT / "tests").rglob("*.py")}
    out = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            out |= {n.split(".")[0] for n in names} - ours - set(sys.stdlib_module_names)
    return out


def test_test_extra_installs_what_the_cpu_tests_import():
    """`pip install -e '.[test]'` is enough for every CPU test and the scripts they run (none skips for a missing
    module); the nvidia extra brings the sm_90 disassemblers."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    declared = {req.split(">")[0].split("=")[0].split("<")[0].split("[")[0].replace("-", "_")
                for req in project["dependencies"] + extras["test"]}
    declared |= set(torchtitan_check_installs())  # the torchtitan check's, installed by scripts/test.sh
    cpu_tests = [p for p in (ROOT / "tests").rglob("*.py") if "gpu" not in p.relative_to(ROOT / "tests").parts]
    imported = _third_party_imports([*cpu_tests, *(ROOT / "scripts").glob("*.py")])
    assert imported - declared == set(), f"imported by the tests but not in the [test] extra: {imported - declared}"
    assert {"nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm"} <= {r.split(">")[0] for r in extras["nvidia"]}
    assert project["scripts"]["epgen"] == "epgen:main"


def test_test_script_and_readme_agree_on_torch():
    """scripts/test.sh (and wheel_check.sh) install torch's CPU build from the index README "Install" names, and
    the version range their comments and the README state is pyproject's."""
    import re

    readme = (ROOT / "README.md").read_text()
    index = re.search(r"`pip install torch --index-url (\S+)`", readme).group(1)
    assert index.endswith("/cpu")
    for script in ("test.sh", "wheel_check.sh"):
        text = (ROOT / "scripts" / script).read_text()
        assert f"TORCH_INDEX_URL-{index}}}" in text, script
        assert re.search(r'pip install -q --no-deps "torch==\$\{?TORCH[^"]*" \$\{\w+:\+--index-url "\$\w+"\}', text), script
    torch_req = {r for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "runtime"] if r.startswith("torch")}.pop()
    major, minor, top_major, top_minor = map(int, re.fullmatch(r"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)", torch_req).groups())
    span = f"{major}.{minor} to {top_major}.{top_minor - 1}"
    assert f"extras admit {span}" in (ROOT / "scripts" / "test.sh").read_text()
    assert f"The extras take torch {span}" in " ".join(readme.split())


def torchtitan_check_installs() -> dict[str, str]:
    """What scripts/test.sh installs for the torchtitan check: {distribution: requirement}."""
    import re

    text = (ROOT / "scripts" / "test.sh").read_text()
    pinned = re.search(r'pip install -q --no-deps "(torchtitan==[^"]+)"', text).group(1)
    deps = re.search(r'^TORCHTITAN_CHECK_DEPS="([^"]+)"', text, re.M).group(1).split()
    assert re.search(r"pip install -q \$TORCHTITAN_CHECK_DEPS", text) and "export EPGEN_REQUIRE_TORCHTITAN=1" in text
    return {req.split("=")[0]: req for req in [pinned, *deps]}


def test_the_torchtitan_check_installs_the_extras_torchtitan():
    """scripts/test.sh installs the torchtitan release the [torchtitan] extra pins (without its training dependencies,
    then the modules its MoE imports: issue 36's measured set), and triton, which the extra adds for torch's CPU
    build."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["torchtitan"]
    installs = torchtitan_check_installs()
    assert installs["torchtitan"] in extra and "triton" in extra and "triton" in installs
    assert {"spmd_types", "tyro"} <= set(installs)
