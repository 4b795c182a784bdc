"""What a user runs to see a job: ``--check`` (the report), ``--hangs`` (the ranks
of a hung job grouped by stack), ``env``; the command line over them."""
