import sys

from nbdist.cli import main

sys.exit(main())
