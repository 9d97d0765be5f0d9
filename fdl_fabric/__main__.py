from .cli import program

program.run()
