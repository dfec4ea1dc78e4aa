import sys

from featcache.cli import main

sys.exit(main())
