"""C++ kernels for the CPU, compiled on first use with `torch.utils.cpp_extension` (needs a C++ compiler and ninja).

Why C++ here and not PyTorch: a decode step through a compressed cache is dozens of small elementwise passes over
the whole history in eager PyTorch, each writing a full-precision temporary; one fused loop reads each packed byte
once and keeps every intermediate in registers and a few kilobytes of scratch.

Where the build goes, and why it never hangs: every build lives in a folder named after a hash of the sources, the
flags and the versions of torch and Python, under `HF_DELTAKV_KERNEL_DIR` or `~/.cache/hf_deltakv/kernels`. A
folder that already holds the built module is imported as it is (it may be read-only, e.g. shipped prebuilt). A build
holds an OS lock (`fcntl.flock`), which the OS releases when the building process dies, so a killed build leaves
nothing that blocks the next one (torch's own lock file, left by a killed build, is removed under it); another
process waits for it at most `BUILD_WAIT_S` seconds. Whatever fails, the callers run the PyTorch reference, with one
warning that names the cause.

Which instructions: the build targets this machine's CPU (`-march=native` on x86: AVX-512 lanes where it has them,
else AVX2, else the scalar lanes of `lanes.h`). `HF_DELTAKV_CPU_ARCH` names another `-march` target (`x86-64-v3`
for a fleet of AVX2 machines, `x86-64` for any x86, `armv8.2-a`, ...), or `none` for the compiler's default; each
target builds into its own folder.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import sys
import time
import warnings
from pathlib import Path

SOURCES = [
    Path(__file__).with_name(name)
    for name in ("stream_attention.cpp", "encode.cpp", "sparse_matvec.cpp", "latent.cpp", "step_ops.cpp", "module.cpp")
]
# Included by the sources: part of the build's hash.
HEADERS = [Path(__file__).with_name(name) for name in ("softmax.h", "rope.h", "planes.h", "lanes.h")]
NAME = "hf_deltakv_cpu"
BUILD_WAIT_S = 600  # how long a process waits for another one's build before running the reference


def _flag_sets() -> list[tuple[list[str], list[str]]]:
    """Compiler and linker flags to try in turn: optimised for this CPU with OpenMP threads, then without OpenMP
    (compilers without it, such as Apple's clang), so the kernels still build, single-threaded. The integers the
    kernels switch on come from Python as `-D` definitions (part of the build's hash, so a change rebuilds)."""
    from ..layout import constants

    native = _arch_flags()
    defines = [f"-D{name}={value}" for name, value in sorted(constants().items())]
    return [(["-O3", *native, "-fopenmp", *defines], ["-fopenmp"]), (["-O3", *native, *defines], [])]


ARCH_ENV = "HF_DELTAKV_CPU_ARCH"


def _arch_flags() -> list[str]:
    """The `-march` flag of the build: `HF_DELTAKV_CPU_ARCH` if set (`none`: no flag), else this x86 CPU's own."""
    arch = os.environ.get(ARCH_ENV, "").strip()
    if arch:
        if not all(c.isalnum() or c in "-_.+" for c in arch):
            raise ValueError(f"{ARCH_ENV}={arch!r} is not a -march target name")
        return [] if arch.lower() == "none" else [f"-march={arch}"]
    return ["-march=native"] if platform.machine().lower() in ("x86_64", "amd64") else []


def kernel_dirs() -> list[Path]:
    """Where built kernels are looked for: `HF_DELTAKV_KERNEL_DIR` (may be read-only), then the user cache."""
    dirs = []
    if os.environ.get("HF_DELTAKV_KERNEL_DIR"):
        dirs.append(Path(os.environ["HF_DELTAKV_KERNEL_DIR"]))
    root = os.environ.get("HF_DELTAKV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_deltakv")
    dirs.append(Path(root) / "kernels")
    return dirs


def build_key(cflags: list[str], ldflags: list[str]) -> str:
    """The name of one build's folder: a hash of everything that changes the module."""
    import torch

    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    for part in (*cflags, "|", *ldflags, torch.__version__, sys.version, platform.machine(), os.environ.get("CXX", "")):
        digest.update(part.encode())
    if "-march=native" in cflags:  # one kernel folder shared by machines with other CPUs: a build per instruction set
        digest.update(" ".join(sorted(cpu_info()[1])).encode())
    return f"cpu-{digest.hexdigest()[:16]}"


def cpu_info() -> tuple[str, set[str]]:
    """This CPU's model name and feature flags as Linux lists them (the flags are what `-march=native` compiles
    for); elsewhere the platform's processor name and no flags."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags = set(value.split())
    except OSError:
        pass
    return model, flags


def _import_built(folder: Path):
    """The module built in `folder`, or None when there is none (torch names a rebuild in one process `NAME_v1`)."""
    from torch.utils.cpp_extension import _import_module_from_library

    built = sorted(folder.glob(f"{NAME}*.so")) if folder.is_dir() else []
    if not built:
        return None
    return _import_module_from_library(built[-1].stem, str(folder), True)


@contextlib.contextmanager
def build_lock(path: Path, wait_s: float):
    """An exclusive OS lock on `path` (released by the OS if this process dies); yields False when another process
    held it for `wait_s` seconds."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): builds are not serialised
        yield True
        return
    with open(path, "a+") as handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.5)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(cflags: list[str], ldflags: list[str]):
    """Import this build from any kernel folder, else build it in the first writable one."""
    key = build_key(cflags, ldflags)
    for root in kernel_dirs():
        module = _import_built(root / key)
        if module is not None:
            return module
    writable = [root for root in kernel_dirs() if _writable(root)]
    if not writable:
        raise RuntimeError(f"no writable folder to build the kernels in (tried {', '.join(map(str, kernel_dirs()))})")
    root = writable[0]
    folder = root / key
    with build_lock(root / f"{key}.lock", BUILD_WAIT_S) as locked:
        if not locked:
            raise RuntimeError(f"another process has been building the kernels for {BUILD_WAIT_S} s ({folder})")
        module = _import_built(folder)  # built by another process while this one waited
        if module is not None:
            return module
        from torch.utils.cpp_extension import load

        folder.mkdir(parents=True, exist_ok=True)
        (folder / "lock").unlink(missing_ok=True)  # torch's lock, left behind by a killed build: nobody holds it
        estimate = _last_build_seconds(root)
        print(f"hf_deltakv: building the CPU kernels for this machine (first use only, ~{estimate:.0f} s) in "
              f"{folder}", file=sys.stderr, flush=True)  # fmt: skip
        started = time.monotonic()
        with _build_progress(folder, estimate):
            module = load(
                name=NAME,
                sources=[str(source) for source in SOURCES],
                extra_cflags=cflags,
                extra_ldflags=ldflags,
                build_directory=str(folder),
                verbose=False,
            )
        with contextlib.suppress(OSError):
            (root / BUILD_SECONDS_FILE).write_text(f"{time.monotonic() - started:.1f}\n")
        return module


BUILD_SECONDS_FILE = "last_build_seconds"  # how long the last build took here: the next estimate
BUILD_ESTIMATE_S = 60.0  # estimate before any build was timed on this machine (2 cores: ~50 s)


def _last_build_seconds(root: Path) -> float:
    try:
        return max(float((root / BUILD_SECONDS_FILE).read_text()), 1.0)
    except (OSError, ValueError):
        return BUILD_ESTIMATE_S


@contextlib.contextmanager
def _build_progress(folder: Path, estimate: float):
    """A progress bar on stderr while the compiler runs (objects compiled so far, time left by `estimate`), so a
    build that takes a minute does not look like a hang."""
    import threading

    try:
        from tqdm.auto import tqdm
    except ImportError:
        yield
        return
    done = threading.Event()
    bar = tqdm(total=round(estimate), desc="building CPU kernels", unit="s", file=sys.stderr,
               bar_format="{desc}: {bar} {n_fmt}/~{total_fmt} s, ~{remaining} left{postfix}")  # fmt: skip

    def tick() -> None:
        started = time.monotonic()
        while not done.wait(1.0):
            objects = len(list(folder.glob("*.o")))
            bar.n = min(round(time.monotonic() - started), bar.total - 1)
            bar.set_postfix_str(f"{objects}/{len(SOURCES)} sources compiled", refresh=True)

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        bar.n = bar.total
        bar.close()


def _writable(root: Path) -> bool:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(root, os.W_OK)


@functools.cache
def prebuilt():
    """The compiled module if a build for this machine already exists (never builds; looked up once), else None."""
    for cflags, ldflags in _flag_sets():
        key = build_key(cflags, ldflags)
        for root in kernel_dirs():
            with contextlib.suppress(Exception):
                module = _import_built(root / key)
                if module is not None:
                    return module
    return None


@functools.cache
def extension():
    """The compiled module, or None when it cannot be built or loaded here (warns once, naming the cause)."""
    errors = []
    for cflags, ldflags in _flag_sets():
        try:
            return _build(cflags, ldflags)
        except Exception as error:  # compiler, ninja or headers missing, a read-only disk: the reference still works
            errors.append(f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error) else ''}")
    warnings.warn(
        f"hf_deltakv: the CPU kernels are not available ({'; '.join(errors)}); using the slower PyTorch reference. "
        "A C++ compiler and `pip install ninja` build them; HF_DELTAKV_KERNEL_DIR may point to prebuilt ones.",
        RuntimeWarning,
        stacklevel=2,
    )
    return None
