"""runtime_root.py ROOT PACKAGE...: the file tree of slipstream's image, assembled in the
build stage of deploy/container/Containerfile (run there by Debian's python3, as root).

The image holds the files of the Debian packages named (deploy/container/image.env,
RUNTIME_PACKAGES: the C library, Python's interpreter and standard library, a shell and
coreutils for the manifests' one-line commands) as dpkg lists them, less what a driver never
reads (:data:`LEFT_OUT`), plus what the build stage made (:data:`FROM_BUILD`: the virtual
environment, the tools, the users and groups).  No package manager, no perl, no compiler:
an application's image installs its own wheels in a build stage of its own and copies
them in (docs/OPERATIONS.md, The image).

Then it checks the tree as it will run (chrooted into ROOT): every ELF file's libraries
resolve there (the dynamic loader's own ``--list``), and every module of the installed
package imports, which also writes the bytecode of the standard library's modules they use
(the rest stays source only: compiled on use, as an interpreter does when it cannot write).
Any failure exits 1 naming the file or module.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

#: Debian's multiarch name of the machine the image is for (this Python's, the base's):
#: x86_64-linux-gnu or aarch64-linux-gnu, the folder of its libraries under /usr/lib.
MULTIARCH: str = sysconfig.get_config_var("MULTIARCH")

#: Paths (prefixes) of the packages' files that are left out, each with why.
LEFT_OUT: dict[str, str] = {
    "/usr/share/man/": "manual pages: no man in the image",
    "/usr/share/info/": "info pages",
    "/usr/share/locale/": "message translations: the driver logs in English",
    "/usr/share/lintian/": "Debian's packaging checks",
    "/usr/share/bug/": "Debian's bug-report hooks",
    "/usr/share/gdb/": "debugger scripts",
    "/usr/share/gcc/": "libstdc++'s debugger pretty-printers",
    "/usr/share/debianutils/": "the shells list's fragments (dpkg's triggers read them)",
    f"/usr/lib/{MULTIARCH}/gconv/": "iconv's converters: Python's codecs are its own",
    f"/usr/lib/{MULTIARCH}/libmvec.": "glibc's vector maths, for code built to use it: none",
    "/usr/lib/python3.11/test/": "CPython's own test suite",
    "/usr/lib/python3.11/idlelib/": "the IDLE editor (needs Tk)",
    "/usr/lib/python3.11/tkinter/": "Tk bindings (no Tk here)",
    "/usr/lib/python3.11/turtledemo/": "turtle graphics demos",
    "/usr/lib/python3.11/lib2to3/": "the Python 2 converter",
    "/usr/lib/python3.11/pydoc_data/": "pydoc's topic texts",
    "/usr/lib/python3.11/ensurepip/": "pip's bootstrap: nothing is installed at run time",
    "/usr/lib/python3.11/distutils/": "building C extensions: the image compiles nothing",
    "/usr/lib/python3.11/venv/": "making environments: the image has its one",
    "/usr/lib/python3.11/lib-dynload/_test": "CPython's test extensions",
    "/usr/lib/python3.11/lib-dynload/_xx": "CPython's example extensions",
    "/usr/lib/python3.11/lib-dynload/xx": "CPython's example extensions",
    "/usr/lib/python3.11/lib-dynload/_ctypes_test": "CPython's test extensions",
    # Extension modules whose libraries are not among the packages: dbm (Berkeley DB), nis
    # (Sun RPC and Kerberos), curses and readline (terminal libraries), sqlite3.
    "/usr/lib/python3.11/lib-dynload/_dbm.": "Berkeley DB is not in the image",
    "/usr/lib/python3.11/lib-dynload/nis.": "Sun RPC and Kerberos are not in the image",
    "/usr/lib/python3.11/lib-dynload/_curses": "ncurses is not in the image",
    "/usr/lib/python3.11/lib-dynload/readline.": "GNU readline is not in the image",
    "/usr/lib/python3.11/lib-dynload/_sqlite3.": "SQLite is not in the image",
    "/usr/lib/python3.11/sqlite3/": "SQLite is not in the image",
    "/usr/lib/python3.11/curses/": "ncurses is not in the image",
}
#: The copyright files stay, each package's licence (under /usr/share/doc/, otherwise out).
KEPT_DOCS = "copyright"

#: What the build stage made, copied as it is: besides slipstream's, what packages' install
#: scripts made, which dpkg does not list: the CA bundle and its links (ca-certificates;
#: OpenSSL looks under /usr/lib/ssl), the time zone (tzdata), and the C.UTF-8 locale
#: (libc-bin's, whose programs stay out).
FROM_BUILD = ("/opt/slipstream", "/usr/local/bin", "/etc/slipstream", "/etc/passwd",
              "/etc/group", "/etc/nsswitch.conf", "/etc/ld.so.conf", "/etc/ld.so.conf.d",
              "/etc/ssl/certs", "/usr/lib/ssl/certs", "/usr/lib/ssl/cert.pem",
              "/etc/localtime", "/etc/timezone", "/usr/lib/locale/C.utf8")
#: Where each package's dpkg status goes, as distroless images keep it, for the scanners
#: that list an image's packages and their known vulnerabilities (there is no dpkg to ask).
STATUS_DIR = "var/lib/dpkg/status.d"
#: Compilers that must not be in the image (nothing in it is built).
COMPILERS = ("cc", "gcc", "c++", "g++", "clang", f"{MULTIARCH}-gcc")
#: Debian's merged /usr: these are links into /usr, as in the base.
MERGED = {"bin": "usr/bin", "sbin": "usr/sbin", "lib": "usr/lib", "lib64": "usr/lib64"}
#: Directories every process may write to (sticky).
SCRATCH = ("tmp", "var/tmp")
#: Directories root's alone (/var/run and /var/lock lead to /run, which not every engine
#: mounts).
ROOT_ONLY = ("run",)
#: Optional dependencies the image leaves out (the package's extras): a module that needs one
#: is not imported by the check.
OPTIONAL = {"pyspark", "pyarrow", "pandas", "matplotlib", "numpy", "hdrh"}
#: The subpackage of the ``spark`` extra, which says itself what it lacks (on import).
NOT_CHECKED = "slipstream.spark_bridge"
#: The first bytes of an ELF file.
ELF_MAGIC = b"\x7fELF"
#: The dynamic loader of each machine, inside the tree: ``LOADER --list FILE`` names FILE's
#: libraries.
LOADERS = {"x86_64-linux-gnu": "/lib64/ld-linux-x86-64.so.2",
           "aarch64-linux-gnu": "/lib/ld-linux-aarch64.so.1"}
#: The build stage's chroot (coreutils): the checks run the tree's own programs in it.
CHROOT = "/usr/sbin/chroot"


def fail(message: str) -> None:
    print(f"runtime_root: {message}", file=sys.stderr)
    raise SystemExit(1)


def canonical(path: str) -> str:
    """``path`` with its directory resolved (/bin/dash -> /usr/bin/dash), the name kept (a
    symbolic link stays one)."""
    head, name = os.path.split(path)
    return os.path.join(os.path.realpath(head), name)


def left_out(path: str) -> bool:
    if path.startswith("/usr/share/doc/"):
        return os.path.basename(path) != KEPT_DOCS
    return any(path.startswith(prefix) for prefix in LEFT_OUT)


def package_files(packages: list[str]) -> list[str]:
    """The files (not directories) of ``packages``, canonical, less :data:`LEFT_OUT`."""
    files = set()
    for package in packages:
        listed = subprocess.run(["dpkg-query", "--listfiles", package], capture_output=True,
                                text=True)
        if listed.returncode != 0:
            fail(f"package {package} is not installed in the base image "
                 f"(BASE_PACKAGES in deploy/container/image.env): {listed.stderr.strip()}")
        for line in listed.stdout.splitlines():
            # "package diverts others to: ..." lines name no file of the package.
            if not line.startswith("/") or (os.path.isdir(line) and not os.path.islink(line)):
                continue
            path = canonical(line)
            if os.path.lexists(path) and not left_out(path):
                files.add(path)
    return sorted(files)


def copy_tree(root: Path, paths: list[str]) -> None:
    """``paths`` (files, or whole trees) from / into ``root``, owners and modes kept."""
    listing = "\0".join(p.lstrip("/") for p in paths) + "\0"
    pack = subprocess.Popen(["tar", "-C", "/", "--null", "-T", "-", "-cf", "-"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    unpack = subprocess.Popen(["tar", "-C", str(root), "-xpf", "-"], stdin=pack.stdout)
    assert pack.stdin is not None and pack.stdout is not None
    pack.stdout.close()
    pack.stdin.write(listing.encode())
    pack.stdin.close()
    if pack.wait() != 0 or unpack.wait() != 0:
        fail("copying the files into the tree failed (tar's message above)")


def share_libcrypto(root: Path) -> None:
    """The wheels' own copies of OpenSSL's libcrypto (auditwheel grafts the build host's into
    ``<package>.libs/``) become links to the image's (libssl3's), when that is OpenSSL of the
    same major version and a newer release: one copy.  The same release is not enough: a
    Debian security update keeps the release and changes the package's revision, so the
    wheel's copy may be the patched one.  The import check then loads every extension with
    all its symbols bound (Python's RTLD_NOW)."""
    system = root / f"usr/lib/{MULTIARCH}/libcrypto.so.3"
    if not system.exists():
        return
    ours = openssl_version(system)
    for bundled in root.glob("opt/slipstream/lib/python3.*/site-packages/*.libs/libcrypto-*"):
        theirs = openssl_version(bundled)
        if ours and theirs and ours[0] == theirs[0] and ours > theirs:
            bundled.unlink()
            bundled.symlink_to(f"/usr/lib/{MULTIARCH}/libcrypto.so.3")
            print(f"runtime_root: {bundled.relative_to(root)} (OpenSSL "
                  f"{'.'.join(map(str, theirs))}) -> the image's libcrypto (OpenSSL "
                  f"{'.'.join(map(str, ours))})")


def openssl_version(library: Path) -> tuple[int, ...] | None:
    """The version OpenSSL's library names itself by ("OpenSSL 3.0.20 7 Apr 2026")."""
    found = re.search(rb"OpenSSL (\d+)\.(\d+)\.(\d+) ", library.read_bytes())
    return tuple(int(n) for n in found.groups()) if found else None


def write_status(root: Path, packages: list[str]) -> None:
    status = root / STATUS_DIR
    status.mkdir(parents=True, exist_ok=True)
    for package in packages:
        text = subprocess.run(["dpkg-query", "--status", package], capture_output=True,
                              text=True, check=True).stdout
        (status / package).write_text(text)


def check_no_compiler(root: Path) -> None:
    found = [f"/usr/{d}/{c}" for d in ("bin", "sbin", "local/bin") for c in COMPILERS
             if os.path.lexists(root / "usr" / d / c)]
    if found:
        fail(f"a compiler is in the image: {', '.join(found)}")


def check_libraries(root: Path) -> None:
    """Every ELF file's libraries resolve inside ``root`` (its loader's ``--list``)."""
    loader = LOADERS.get(MULTIARCH)
    if loader is None or not os.path.lexists(root / loader.lstrip("/")):
        fail(f"no dynamic loader of {MULTIARCH} in the tree (runtime_root knows {sorted(LOADERS)})")
    missing = []
    for folder, _dirs, names in os.walk(root):
        for name in names:
            path = Path(folder, name)
            if path.is_symlink() or not path.is_file():
                continue
            with open(path, "rb") as file:
                if file.read(4) != ELF_MAGIC:
                    continue
            inside = "/" + str(path.relative_to(root))
            listed = subprocess.run([CHROOT, str(root), loader, "--list", inside],
                                    capture_output=True, text=True)
            for line in (listed.stdout + listed.stderr).splitlines():
                if "not found" in line:
                    missing.append(f"{inside}: {line.strip()}")
    if missing:
        fail("libraries missing from the image (add their package to RUNTIME_PACKAGES, or "
             "leave the file out in LEFT_OUT):\n  " + "\n  ".join(missing))


#: Run by the image's Python in the tree: import every module of the installed package.
IMPORT_ALL = """
import importlib, pkgutil, sys
optional, skipped = set(sys.argv[1].split(",")), sys.argv[2]
import slipstream
failed = []
for module in pkgutil.walk_packages(slipstream.__path__, "slipstream."):
    if (module.name == skipped or module.name.startswith(skipped + ".")
            or module.name.endswith(".__main__")):  # __main__ runs a command
        continue
    try:
        importlib.import_module(module.name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in optional:
            failed.append(f"{module.name}: {e!r}")
    except Exception as e:
        failed.append(f"{module.name}: {e!r}")
if failed:
    sys.exit("modules that do not import:\\n  " + "\\n  ".join(failed))
"""


def check_imports(root: Path) -> None:
    env = {"PATH": "/opt/slipstream/bin:/usr/bin:/bin", "HOME": "/nonexistent"}
    result = subprocess.run([CHROOT, str(root), "/opt/slipstream/bin/python", "-c",
                             IMPORT_ALL, ",".join(sorted(OPTIONAL)), NOT_CHECKED], env=env)
    if result.returncode != 0:
        fail("the installed package does not import in the tree (above)")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        fail("usage: runtime_root.py ROOT PACKAGE...")
    root, packages = Path(argv[0]), argv[1:]
    root.mkdir(parents=True, exist_ok=True)
    (root / "usr").mkdir(exist_ok=True)
    for link, target in MERGED.items():
        (root / target).mkdir(parents=True, exist_ok=True)
        (root / link).symlink_to(target)
    copy_tree(root, [*package_files(packages), *FROM_BUILD])
    for scratch in SCRATCH:
        (root / scratch).mkdir(parents=True, exist_ok=True)
        (root / scratch).chmod(0o1777)
    (root / "root").mkdir(mode=0o700, exist_ok=True)  # root's home
    for directory in ROOT_ONLY:
        (root / directory).mkdir(mode=0o755, exist_ok=True)
    if shutil.which("ldconfig"):
        subprocess.run(["ldconfig", "-r", str(root)], check=True)
    share_libcrypto(root)
    write_status(root, packages)
    check_no_compiler(root)
    check_libraries(root)
    check_imports(root)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
