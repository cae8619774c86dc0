"""The CPU kernels' build never hangs and loads from where it can: stale locks, bounded waits, prebuilt read-only
folders, the environment switch; the instruction sets this machine does not build by default build and match too."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time

import pytest

from hf_deltakv import kernels
from hf_deltakv.kernels import cpu


def test_a_lock_held_elsewhere_is_waited_for_a_bounded_time_and_freed_when_its_holder_dies(tmp_path):
    path = tmp_path / "build.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time\nf = open(sys.argv[1], 'a+')\nfcntl.flock(f, fcntl.LOCK_EX)\n"
         "print('held', flush=True)\ntime.sleep(60)", str(path)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    started = time.monotonic()
    with cpu.build_lock(path, wait_s=1.0) as locked:
        assert not locked
    assert time.monotonic() - started < 10
    holder.kill()  # a build killed mid-way (Ctrl-C, OOM): the OS releases its lock
    holder.wait()
    with cpu.build_lock(path, wait_s=5.0) as locked:
        assert locked


def test_a_stale_torch_lock_is_removed_before_building(tmp_path, monkeypatch):
    """torch's own build lock, left by a killed build, made every later process wait forever."""
    monkeypatch.setenv("HF_DELTAKV_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("HF_DELTAKV_CACHE", str(tmp_path / "cache"))  # no earlier build to import
    cflags, ldflags = cpu._flag_sets()[0]
    folder = tmp_path / cpu.build_key(cflags, ldflags)
    folder.mkdir()
    (folder / "lock").write_text("")
    seen = {}

    def fake_load(**kwargs):
        seen["stale lock"] = (folder / "lock").exists()
        seen["folder"] = kwargs["build_directory"]
        raise RuntimeError("not built in this test")

    import torch.utils.cpp_extension

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    with pytest.raises(RuntimeError, match="not built"):
        cpu._build(cflags, ldflags)
    assert seen == {"stale lock": False, "folder": str(folder)}


def test_a_prebuilt_kernel_loads_from_a_folder_it_cannot_write(tmp_path):
    """Copy the built module to a folder, make every writable place unusable, and load it from there."""
    assert cpu.extension() is not None
    cflags, ldflags = cpu._flag_sets()[0]
    key = cpu.build_key(cflags, ldflags)
    source = next(root / key for root in cpu.kernel_dirs() if (root / key).is_dir())
    prebuilt = tmp_path / "prebuilt" / key
    prebuilt.mkdir(parents=True)
    for built in source.glob(f"{cpu.NAME}*.so"):
        (prebuilt / built.name).write_bytes(built.read_bytes())
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # HF_DELTAKV_CACHE under a file: nothing can be created there
    env = {**os.environ, "HF_DELTAKV_KERNEL_DIR": str(prebuilt.parent), "HF_DELTAKV_CACHE": str(blocker / "x")}
    os.chmod(prebuilt, 0o555)
    code = "from hf_deltakv.kernels.cpu import extension; assert extension() is not None; print('loaded')"
    done = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", code], env=env, capture_output=True, text=True
    )
    os.chmod(prebuilt, 0o755)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded" in done.stdout and "building" not in done.stderr


def test_prebuilt_never_builds_and_runs_the_reference_without_a_build(tmp_path):
    """`HF_DELTAKV_KERNELS=prebuilt` (what the quick `hf-deltakv ppl` sets): no build where none exists, the
    reference serves, and a build that exists is used."""
    code = (
        "import torch\nfrom hf_deltakv import kernels\n"
        "print('compiled' if kernels._cpu_extension(torch.device('cpu')) is not None else 'reference')"
    )
    env = {**os.environ, "HF_DELTAKV_KERNELS": "prebuilt", "HF_DELTAKV_CACHE": str(tmp_path)}
    env.pop("HF_DELTAKV_KERNEL_DIR", None)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "reference" and "building" not in done.stderr
    assert time.monotonic() - started < 60 and not (tmp_path / "kernels").exists()
    assert cpu.extension() is not None  # this process's build (the default user cache) is found as prebuilt
    env["HF_DELTAKV_CACHE"] = os.environ.get("HF_DELTAKV_CACHE", os.path.expanduser("~/.cache/hf_deltakv"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == "compiled", done.stderr[-2000:]


def test_kernel_switch_is_checked(monkeypatch):
    monkeypatch.setenv("HF_DELTAKV_KERNELS", "garbage")
    with pytest.raises(ValueError, match="HF_DELTAKV_KERNELS must be one of"):
        kernels.forced_reference()
    monkeypatch.setenv("HF_DELTAKV_KERNELS", "Reference")
    assert kernels.forced_reference()
    monkeypatch.setenv("HF_DELTAKV_KERNELS", "auto")
    assert not kernels.forced_reference()
    monkeypatch.setenv("HF_DELTAKV_KERNELS", "prebuilt")
    assert kernels.kernel_choice() == "prebuilt" and not kernels.forced_reference()


def test_the_cpu_arch_switch_is_checked(monkeypatch):
    monkeypatch.setenv(cpu.ARCH_ENV, "x86-64-v3")
    assert cpu._arch_flags() == ["-march=x86-64-v3"]
    monkeypatch.setenv(cpu.ARCH_ENV, "none")
    assert cpu._arch_flags() == []
    monkeypatch.setenv(cpu.ARCH_ENV, "native; rm -rf /")
    with pytest.raises(ValueError, match="not a -march target"):
        cpu._arch_flags()


def test_a_native_build_is_keyed_by_the_cpus_instruction_sets(monkeypatch):
    """A kernel folder shared by machines with other CPUs (HF_DELTAKV_KERNEL_DIR on a network disk) holds one
    -march=native build per instruction set, never one machine's AVX-512 build loaded by an AVX2 machine."""
    native, named = (["-O3", "-march=native"], []), (["-O3", "-march=x86-64-v3"], [])
    monkeypatch.setattr(cpu, "cpu_info", lambda: ("a CPU", {"avx2", "fma", "sse2"}))
    keys = cpu.build_key(*native), cpu.build_key(*named)
    monkeypatch.setattr(cpu, "cpu_info", lambda: ("a CPU", {"avx2", "avx512f", "fma", "sse2"}))
    assert cpu.build_key(*native) != keys[0]
    assert cpu.build_key(*named) == keys[1]  # a named target is the same build on every machine


# The lanes the build picks (lanes.h and every `#if __AVX2__` branch): AVX2 without AVX-512, then none (SSE2, which
# is also what an ARM build's lanes are). This machine's own (-march=native) is what every other test runs.
OTHER_ARCHS = {"x86-64-v3": "AVX2 lanes", "x86-64": "scalar lanes"}


@pytest.mark.parametrize("arch", sorted(OTHER_ARCHS))
def test_the_kernels_of_other_instruction_sets_build_and_match_the_reference(arch):
    """Built for another `-march` (its own folder), the kernels pass the kernel tests that compare them with the
    PyTorch reference: the AVX2 and scalar paths are tested on a machine with AVX-512, not only compiled."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"{arch} is an x86 target; this machine is {platform.machine()}")
    env = {**os.environ, cpu.ARCH_ENV: arch, "HF_DELTAKV_KERNELS": "auto"}
    built = subprocess.run(
        [sys.executable, "-c", "import sys; from hf_deltakv.kernels import cpu; sys.exit(cpu.extension() is None)"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert built.returncode == 0, f"the {OTHER_ARCHS[arch]} did not build: {built.stderr[-2000:]}"
    here = os.path.dirname(os.path.abspath(__file__))
    tests = [os.path.join(here, f"test_{name}.py") for name in ("kernels_cpu", "attention", "residual", "weight_skip")]
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-k", "kernel or decoder", *tests],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-3000:]
    assert " passed" in ran.stdout, ran.stdout[-1000:]
    skipped = [line for line in ran.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all("only the scalar decoder" in line for line in skipped), skipped  # the latent vector decoders need AVX2


def test_a_wheel_install_decodes_through_the_compiled_kernel(tmp_path):
    """`pip wheel .` carries every file the package needs: installed from the wheel (not this checkout), a decode step
    is served by the compiled kernel, never by the PyTorch reference."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", root, "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next(tmp_path.glob("hf_deltakv-*.whl"))
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    for source in (*cpu.SOURCES, *cpu.HEADERS):
        assert f"hf_deltakv/kernels/cpu/{source.name}" in names
    assert "hf_deltakv/residual/checkpoints/smollm2-135m/compressor.safetensors" in names
    target = tmp_path / "site"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-2000:]
    smoke = """
import torch, hf_deltakv
from transformers import AutoModelForCausalLM, LlamaConfig
from hf_deltakv import DeltaKVCache, kernels
assert hf_deltakv.__file__.startswith(TARGET), hf_deltakv.__file__
def refuse(*args, **kwargs):
    raise AssertionError("the reference served a decode step")
kernels.reference.stream_attention = refuse
torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
model = AutoModelForCausalLM.from_config(config).eval()
out = model.generate(torch.randint(3, 128, (1, 40)), max_new_tokens=4, do_sample=False, cache=DeltaKVCache(kf=32))
print("decoded", out.shape[1])
""".replace("TARGET", repr(str(target)))
    env = {**os.environ, "PYTHONPATH": str(target)}
    done = subprocess.run([sys.executable, "-c", smoke], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "decoded 44" in done.stdout
