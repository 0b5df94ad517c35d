from moelora.cli import main

raise SystemExit(main())
