from pdtrace.cli import main

main()
