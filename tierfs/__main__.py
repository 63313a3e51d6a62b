"""``python -m tierfs`` runs the command line."""

from tierfs.cli.main import main

if __name__ == "__main__":
    main()
