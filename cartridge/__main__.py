"""`python -m cartridge ARGS`: the `cartridge` command, as `python -m mlx_lm ...` runs mlx-lm's."""

from .cli.entry import main

if __name__ == "__main__":
    main()
