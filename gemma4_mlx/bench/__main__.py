from .speed import main

main()
