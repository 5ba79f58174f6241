"""`python -m dspark <command>`: the same as the `dspark` console script."""
import sys

from dspark.cli import main

sys.exit(main())
