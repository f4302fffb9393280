// Command contextfiles prints the files of a Docker build context that survive its
// .dockerignore, one relative path per line, using moby/patternmatcher: the matcher the
// Docker CLI and BuildKit apply to the context (MatchesOrParentMatches, with `!` exceptions).
//
//	contextfiles <context-dir>
package main

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/moby/patternmatcher"
	"github.com/moby/patternmatcher/ignorefile"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: contextfiles <context-dir>")
		os.Exit(2)
	}
	if err := run(os.Args[1]); err != nil {
		fmt.Fprintln(os.Stderr, "contextfiles:", err)
		os.Exit(1)
	}
}

func run(root string) error {
	var patterns []string
	if f, err := os.Open(filepath.Join(root, ".dockerignore")); err == nil {
		patterns, err = ignorefile.ReadAll(f)
		f.Close()
		if err != nil {
			return err
		}
	} else if !os.IsNotExist(err) {
		return err
	}
	pm, err := patternmatcher.New(patterns)
	if err != nil {
		return err
	}
	return filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, path)
		if err != nil || rel == "." {
			return err
		}
		rel = filepath.ToSlash(rel)
		skip, err := pm.MatchesOrParentMatches(rel)
		if err != nil {
			return err
		}
		if skip {
			if d.IsDir() && !reincluded(pm, rel) {
				return filepath.SkipDir
			}
			return nil
		}
		if !d.IsDir() {
			fmt.Println(rel)
		}
		return nil
	})
}

// reincluded reports whether an exception pattern (`!...`) may re-include something
// below the excluded directory dir, so the walk has to descend into it.
func reincluded(pm *patternmatcher.PatternMatcher, dir string) bool {
	if !pm.Exclusions() {
		return false
	}
	for _, p := range pm.Patterns() {
		if !p.Exclusion() {
			continue
		}
		text := p.String()
		if strings.HasPrefix(text, dir+"/") || strings.ContainsAny(text, "*?[") {
			return true
		}
	}
	return false
}
