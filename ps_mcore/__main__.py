import sys

from ps_mcore.cli import main

sys.exit(main())
