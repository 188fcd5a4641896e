from ascendstore.cli import main

main()
