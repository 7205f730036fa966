"""``python -m lightning_act``: the same as the ``lightning-act`` command."""

from lightning_act.cli import main

if __name__ == "__main__":
    main()
