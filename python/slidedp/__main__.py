import sys

from slidedp.cli import main

sys.exit(main())
