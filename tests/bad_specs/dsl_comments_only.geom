# nothing here yet
   # still nothing
