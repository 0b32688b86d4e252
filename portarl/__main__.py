import sys

from portarl.cli import main

# Guarded: vLLM and multiprocessing spawn child processes that import __main__.
if __name__ == "__main__":
    sys.exit(main())
