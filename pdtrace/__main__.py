from pdtrace.cli import console_main

console_main()
