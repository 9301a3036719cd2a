import sys

from pagekv.cli import main

sys.exit(main())
