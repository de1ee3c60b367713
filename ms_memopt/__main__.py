import sys

from ms_memopt.cli import main

sys.exit(main())
