import sys

from imager.cli import main

sys.exit(main())
