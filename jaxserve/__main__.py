"""The `jaxserve` script and `python -m jaxserve`. A command that runs steps is started again with tcmalloc
preloaded (`allocator.py`) before the CLI's imports, so the first start costs the interpreter's alone;
then the CLI (`cli.py`) parses and runs it."""

import contextlib
import sys

from jaxserve.allocator import preload_tcmalloc, runs_steps


def main() -> None:
    if runs_steps(sys.argv[1:]):
        with contextlib.suppress(ValueError):  # a bad JAXSERVE_ALLOCATOR: the CLI, calling it again, reports it
            preload_tcmalloc()
    from jaxserve.cli import main as run_cli

    run_cli()


if __name__ == "__main__":
    main()
