"""`python -m hf_deltakv.lm_eval ...`: lm-eval's command line with the `hf-deltakv` model registered and our
offline tasks (`hf_deltakv_python_docs`, `hf_deltakv_stdlib_code`, `hf_deltakv_text`) on the include path."""

from __future__ import annotations

import sys

from . import TASKS_DIR


def main(argv: list[str] | None = None) -> None:
    from lm_eval.__main__ import cli_evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--include_path" in argv:
        i = argv.index("--include_path") + 1
        argv[i] = f"{argv[i]}:{TASKS_DIR}"
    elif argv and argv[0] not in ("-h", "--help"):
        argv += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["lm-eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
