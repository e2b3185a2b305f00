import sys

from xsched.cli import main

sys.exit(main())
