"""The fake `uv` of the fake TPU workers (see fake_cloud/__init__.py).

`uv venv --python V DIR` makes a venv of this Python (no download) that
sees its packages, and in which Python starts as on a pod worker
(its sitecustomize imports fake_tpu_vm). This Python may itself be a venv's
(the suite run in a fresh venv, as most users install): the new venv sees
the site directories this Python sees, not its base interpreter's, which
`--system-site-packages` would give; `uv pip install --python PY -e SRC ...` puts SRC first on
that venv's path (the packages themselves are this Python's already).
"""

import pathlib
import site
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import fake_cloud  # noqa: E402  pylint: disable=wrong-import-position


def site_packages(venv):
  return next(pathlib.Path(venv).glob("lib/python3*/site-packages"))


def site_directories():
  """The site directories of the Python running this (a venv's own, then
  any it inherits, then the user's) that exist."""
  found = site.getsitepackages()
  if site.ENABLE_USER_SITE:
    found.append(site.getusersitepackages())
  return [d for d in found if pathlib.Path(d).is_dir()]


def fail(message):
  print(f"error: {message}", file=sys.stderr)
  return 2


def main(argv):
  args = [a for a in argv[2:] if a != "--quiet"]
  fake_cloud.record("uv", args, home=str(pathlib.Path.home()))
  if args[:1] == ["venv"]:
    if len(args) != 4 or args[1] != "--python":
      return fail(f"the fake takes venv --python VERSION DIR, got {args}")
    version, venv = args[2], args[3]
    if f"{sys.version_info.major}.{sys.version_info.minor}" != version:
      return fail(f"the fake has Python {sys.version.split()[0]}, not "
                  f"{version}")
    subprocess.check_call([sys.executable, "-m", "venv", "--without-pip",
                           venv])
    # This Python's site directories, with the .pth files in them (an
    # editable install's included), after the venv's own: named to come
    # after _jaxrlhf_src.pth, so the workers' copy of the package is first.
    (site_packages(venv) / "zz_running_python.pth").write_text(
        "import site; " + "; ".join(
            f"site.addsitedir({d!r})" for d in site_directories()) + "\n")
    # Imported once every site directory is on the path (jax included).
    (site_packages(venv) / "sitecustomize.py").write_text(
        f"import sys\nsys.path.append({str(fake_cloud.HERE)!r})\n"
        "import fake_tpu_vm\n")
    return 0
  if args[:2] == ["pip", "install"]:
    rest = args[2:]
    if rest[:1] != ["--python"] or "-e" not in rest:
      return fail(f"the fake takes pip install --python PY -e SRC ..., got "
                  f"{args}")
    python = pathlib.Path(rest[1])
    source = pathlib.Path(rest[rest.index("-e") + 1])
    if not (source / "setup.cfg").exists():
      return fail(f"{source} is not a Python project")
    venv = python.parent.parent
    (site_packages(venv) / "_jaxrlhf_src.pth").write_text(f"{source}\n")
    return 0
  return fail(f"the fake knows no uv {' '.join(args)}")


if __name__ == "__main__":
  sys.exit(main(sys.argv))
