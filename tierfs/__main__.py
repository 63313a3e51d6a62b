"""``python -m tierfs`` runs the command line."""

from tierfs.cli import main

if __name__ == "__main__":
    main()
