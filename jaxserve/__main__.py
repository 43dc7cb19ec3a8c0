"""`python -m jaxserve`: the same CLI as the `jaxserve` script."""

from jaxserve.cli import main

if __name__ == "__main__":
    main()
