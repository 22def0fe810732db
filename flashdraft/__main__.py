import sys

from flashdraft.cli import main

sys.exit(main())
