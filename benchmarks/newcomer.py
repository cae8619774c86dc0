"""Time the README's two set-up commands as a newcomer runs them: a fresh clone, a fresh venv, an empty model and
kernel cache.

python benchmarks/newcomer.py               # install + `hf-deltakv ppl` twice (~5 min)
python benchmarks/newcomer.py --tests       # also the test command (~20 min more on 2 cores)

The commands are read from the README's two code blocks under "Set up" (what a newcomer copies), split at their
`&&` into the install and the run; each is timed on its own. The first `hf-deltakv ppl` starts with no converted
model and no built kernels (`HF_DELTAKV_CACHE` is a new folder), the second finds both. Writes
benchmarks/results/newcomer.json; `readme_tables.py` renders it.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paths import RESULTS, machine

from hf_deltakv.compare import write_json

ROOT = Path(__file__).resolve().parent.parent


def readme_commands(readme: Path = ROOT / "README.md") -> list[str]:
    """The bash blocks of the README's "Set up" section, in order."""
    text = readme.read_text()
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def run(command: str, cwd: Path, env: dict, log: Path) -> float:
    """Seconds `command` took in bash, in the venv; its output goes to `log`; a failure stops the benchmark."""
    started = time.monotonic()
    with log.open("w") as out:
        done = subprocess.run(["bash", "-c", f". .venv/bin/activate && {command}"], cwd=cwd, env=env, stdout=out,
                              stderr=subprocess.STDOUT)  # fmt: skip
    seconds = time.monotonic() - started
    if done.returncode:
        sys.exit(f"`{command}` failed after {seconds:.0f} s; see {log}")
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", action="store_true", help="also time the test command")
    parser.add_argument("--out", default=str(RESULTS / "newcomer.json"))
    args = parser.parse_args()
    first, second = readme_commands()
    install, quick = (part.strip() for part in first.rsplit("&&", 1))
    test_install, tests = (part.strip() for part in second.rsplit("&&", 1))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run([sys.executable, "-m", "venv", str(clone / ".venv")], check=True)
        env = {**os.environ, "HF_DELTAKV_CACHE": str(Path(tmp) / "cache")}
        env.pop("HF_DELTAKV_KERNEL_DIR", None)
        steps = [("install (command 1)", install), ("hf-deltakv ppl, first run", quick),
                 ("hf-deltakv ppl, second run", quick)]  # fmt: skip
        if args.tests:
            steps += [("install (command 2)", test_install), ("tests", tests)]
        for name, command in steps:
            seconds = run(command, clone, env, Path(tmp) / f"{len(rows)}.log")
            rows.append({"step": name, "command": command, "seconds": round(seconds, 1)})
            print(f"{name}: {seconds:.0f} s  ({command})", flush=True)
        table = (clone / "hf-deltakv-out" / "ppl.json").exists()
        outputs = sorted(path.name for path in (clone / "hf-deltakv-out").iterdir())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    config = {
        "commit": commit.stdout.strip(),
        "cores": os.cpu_count(),
        "machine": machine(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "protocol": "a fresh clone and venv; HF_DELTAKV_CACHE a new folder, so the first `hf-deltakv ppl` converts the "
        "embedded model; each step timed on its own, in order",
        "wrote_ppl_json": table,
        "out_folder_after_both_runs": outputs,
    }
    write_json({"config": config, "rows": rows}, args.out)
    print(f"wrote {args.out}; commands: {' | '.join(shlex.quote(r['command']) for r in rows)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
