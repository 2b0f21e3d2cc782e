from shmprod.cli import main

raise SystemExit(main())
