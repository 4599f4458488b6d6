import sys

from slidedp.entry import main

if __name__ == "__main__":
    sys.exit(main())
