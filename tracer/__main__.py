import sys

from tracer.cli import console_main

sys.exit(console_main())
