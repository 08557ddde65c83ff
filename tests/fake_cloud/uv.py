"""The fake `uv` of the fake TPU workers (see fake_cloud/__init__.py).

`uv venv --python V DIR` makes a venv of this Python (no download) that
sees its packages, and in which Python starts as on a pod worker
(its sitecustomize imports fake_tpu_vm); `uv pip install --python PY -e SRC ...` puts SRC first on
that venv's path (the packages themselves are this Python's already).
"""

import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import fake_cloud  # noqa: E402  pylint: disable=wrong-import-position


def site_packages(venv):
  return next(pathlib.Path(venv).glob("lib/python3*/site-packages"))


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
                           "--system-site-packages", venv])
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
