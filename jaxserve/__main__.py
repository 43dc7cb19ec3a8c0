from jaxserve.cli import main

main()
