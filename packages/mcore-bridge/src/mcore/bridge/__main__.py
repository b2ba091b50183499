import sys

from mcore.bridge.cli import main

sys.exit(main())
