import sys

from mcore.train.cli import main

sys.exit(main())
