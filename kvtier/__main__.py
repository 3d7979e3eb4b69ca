from kvtier.cli.main import main

raise SystemExit(main())
