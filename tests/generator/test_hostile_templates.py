"""Issue 26 (trust, round two), template part: templates come from the project's templates/ unless the
user names a folder (`--templates`); every template renders in a sandbox; no template is read through a
link out of its folder.

Every test here failed on 7b1a81d.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from generator import build as B
from generator import render
from tests.support.spec_edit import mutate

ROOT = Path(__file__).resolve().parents[2]
EVIL = '{{ cycler.__init__.__globals__.os.system("touch %s") }}\n'


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "generator", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture
def hostile(tmp_path) -> tuple[Path, Path, Path]:
    """(a spec folder, the hostile template folder beside it, the file its template would create)."""
    shutil.copytree(ROOT / "specs", tmp_path / "specs")
    shutil.copytree(ROOT / "templates", tmp_path / "templates")
    marker = tmp_path / "pwned"
    variant = tmp_path / "templates" / "variant.j2"
    variant.write_text(EVIL % marker + variant.read_text())
    return tmp_path / "specs", tmp_path / "templates", marker


def test_templates_beside_a_spec_folder_are_not_used(hostile, tmp_path):
    specs, _, marker = hostile
    out = tmp_path / "gen"
    r = cli("--specs", str(specs), "build", "--arch", "gfx950", "--no-compile", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert not marker.exists()
    for p in (out / "gfx950").iterdir():  # the project's templates rendered them
        assert p.read_text() == (ROOT / "generated" / "gfx950" / p.name).read_text(), p


def test_a_named_template_folder_renders_in_a_sandbox(hostile, tmp_path):
    specs, templates, marker = hostile
    out = tmp_path / "gen"
    r = cli("--specs", str(specs), "--templates", str(templates), "build", "--arch", "gfx950", "--no-compile",
            "--out", str(out))
    assert r.returncode == 2 and not marker.exists(), (r.returncode, r.stderr)
    assert r.stderr == ("error: template: templates/variant.j2:1: access to attribute '__init__' of 'type' "
                        "object is unsafe.\n"), r.stderr


def test_a_named_template_folder_is_used(tmp_path):
    shutil.copytree(ROOT / "templates", tmp_path / "templates")
    variant = tmp_path / "templates" / "variant.j2"
    variant.write_text(variant.read_text().replace("-- do not edit.", "-- do not edit (own templates)."))
    r = cli("--templates", str(tmp_path / "templates"), "build", "--arch", "gfx950", "--no-compile", "--out",
            str(tmp_path / "gen"))
    assert r.returncode == 0, r.stderr
    assert "(own templates)" in next((tmp_path / "gen" / "gfx950").glob("*.hip")).read_text()
    r = cli("--templates", str(tmp_path / "templates"), "check", "--arch", "gfx950", "--out", str(tmp_path / "gen"))
    assert r.returncode == 0 and "fresh" in r.stdout, r.stdout + r.stderr


def test_templates_flag_needs_a_template_folder(tmp_path):
    r = cli("--templates", str(tmp_path), "check", "--arch", "gfx950")
    assert r.returncode != 0 and r.stderr == f"error: --templates {str(tmp_path)!r}: no variant.j2 in that folder\n"


@pytest.mark.parametrize("source", [
    "{{ cycler.__init__.__globals__ }}", "{{ ''.__class__.__mro__ }}", "{{ family.__class__ }}",
    "{{ lipsum.__globals__['os'] }}", "{{ range.__self__ }}",
])
def test_sandbox_refuses_internals(specs, source):
    env = render.environment()
    with pytest.raises((jinja2.exceptions.SecurityError, jinja2.exceptions.UndefinedError)):
        env.from_string(source).render(family=next(iter(specs.families.values())))


# ---------------------------------------------------------------------------------------------
# 6: no template is read through a link that leaves the template folder
# ---------------------------------------------------------------------------------------------
def test_kernel_template_linked_out_of_the_folder_is_refused(spec_copy, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-CONTENT\n")
    templates = tmp_path / "own-templates"
    shutil.copytree(ROOT / "templates", templates)
    (templates / "kernels" / "evil.j2").symlink_to(secret)
    (spec_copy.parent / "templates").unlink()
    (spec_copy.parent / "templates").symlink_to(templates)  # the loader's existence check finds evil.j2 there
    mutate(spec_copy / "kernels.toml", 'template = "kernels/quantize.j2"', 'template = "kernels/evil.j2"')
    out = tmp_path / "gen"
    r = cli("--specs", str(spec_copy), "--templates", str(templates), "build", "--arch", "gfx950", "--no-compile",
            "--out", str(out))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(r.stderr.splitlines()) == 1 and "kernels/evil.j2" in r.stderr and "outside the template folder" in r.stderr
    assert not any("SECRET" in p.read_text() for p in out.rglob("*") if p.is_file())


def test_links_inside_the_folder_still_work(tmp_path):
    (tmp_path / "real.j2").write_text("ok {{ x }}")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "link.j2").symlink_to(tmp_path / "real.j2")
    assert render.environment(tmp_path).get_template("sub/link.j2").render(x=1) == "ok 1"


def test_render_target_uses_the_named_folder_only(specs, tmp_path):
    shutil.copytree(ROOT / "templates", tmp_path / "t")
    (tmp_path / "t" / "variant.j2").write_text("// mine\n")
    files, _ = B.render_target(specs, "gfx950", tmp_path / "t")
    assert {t for n, t in files.items() if n != "manifest.json"} == {"// mine\n"}
    files, _ = B.render_target(specs, "gfx950")
    assert all(t.startswith("// Generated by epgen") for n, t in files.items() if n != "manifest.json")
