import sys

from portarl.cli import main

sys.exit(main())
