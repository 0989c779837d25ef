import sys

from geomopt.cli.main import main

sys.exit(main())
