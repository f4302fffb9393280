module trellis.local/deploy/contextfiles

go 1.22

require github.com/moby/patternmatcher v0.6.1
