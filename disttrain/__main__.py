from disttrain.cli import main

raise SystemExit(main())
