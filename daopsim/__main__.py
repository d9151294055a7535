"""``python -m daopsim``: the ``daopsim`` command line."""

from daopsim.simulator.cli import main

if __name__ == "__main__":
    main(prog_name="daopsim")
