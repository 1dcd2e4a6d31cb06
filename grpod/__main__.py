import sys

from grpod.cli import main

sys.exit(main())
