"""Console-script entry point. Importing the CLI loads MLX, mlx-lm and transformers (about a second);
a Ctrl-C during those imports gets the same one line and exit status 130 as one during a command."""

import sys


def main():
    """Import the CLI and run it; an interrupt while importing exits 130 with one line."""
    try:
        from .main import exit_if_served, main as run  # (inside the try: Ctrl-C while importing exits 130)
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        sys.exit(130)
    run()
    exit_if_served()


if __name__ == "__main__":
    main()
